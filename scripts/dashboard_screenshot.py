"""Screenshot a running dashboard (how docs/dashboard*.png were made), in Debian's headless Chromium.

    .venv/bin/python scripts/dashboard_screenshot.py http://127.0.0.1:8000/dashboard docs/dashboard.png
    CLAWR1_ADMIN_KEY=... .venv/bin/python scripts/dashboard_screenshot.py URL OUT.png   # a key-protected one
"""

from __future__ import annotations

import os
import sys

from playwright.sync_api import sync_playwright


def main(url: str, out: str, width: int = 1400) -> None:
    key = os.environ.get("CLAWR1_ADMIN_KEY")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
            "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"])
        page = browser.new_page(viewport={"width": width, "height": 900}, device_scale_factor=1)
        page.set_extra_http_headers({"Authorization": f"Bearer {key}"} if key else {})
        page.goto(url)
        page.wait_for_load_state("networkidle")
        page.screenshot(path=out, full_page=True)
        browser.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
