"""The processes: what `clawr1 serve`, `up`, `train`, `train-flow` and `run-agent` run, and how.

- `server`: the one way to run the app under uvicorn with background jobs (here, or on a thread);
- `serve`: the gateway (`clawr1 serve`; `up` and the Ray head serve through it too);
- `up`: the main job (gateway + judge here, the trainer as a supervised child process);
- `up_ray`: the main job with its roles as Ray actors (`up --ray`; the actors are `clawr1.cluster`'s);
- `train`: the trainer process (one, or N data-parallel ranks);
- `supervise`: the one supervisor (a child process or a Ray actor's loop, started again when it dies);
- `logs`: the long-running commands' logging (rich or JSON lines, secrets redacted);
- `inprocess`, `whitebox`, `blackbox`: the offline runners (the whole stack in this process).

Entrypoints import the roles (gateway, trainer, reward, flows, the Ray cluster); no role imports an
entrypoint, so flows, envs and the demo stay clients of the gateway (`tests/unit/test_layers.py`).
"""
