// Refreshes the dashboard's panels in place every few seconds: one request returns every panel's
// server-rendered HTML. A lost sign-in (401) reloads the page, which then shows the sign-in form.
(function () {
  "use strict";
  const main = document.querySelector("main[data-refresh]");
  const live = document.getElementById("live");
  if (!main) return;
  const every = 1000 * Number(main.dataset.refresh || 5);
  async function refresh() {
    try {
      const response = await fetch("/dashboard/panels" + window.location.search,  // keeps ?tenant=
                                   {credentials: "same-origin", cache: "no-store"});
      if (response.status === 401) { window.location.reload(); return; }
      if (!response.ok) throw new Error("HTTP " + response.status);
      const panels = await response.json();
      for (const element of document.querySelectorAll("[data-panel]")) {
        const html = panels[element.dataset.panel];
        if (html !== undefined) element.innerHTML = html;  // server-rendered and escaped there
      }
      live.textContent = "updated " + new Date().toLocaleTimeString();
      live.className = "note";
    } catch (error) {
      live.textContent = "refresh failed (" + error.message + "); retrying";
      live.className = "note neg";
    }
  }
  live.textContent = "live, every " + every / 1000 + " s";
  setInterval(refresh, every);
})();
