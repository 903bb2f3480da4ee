"""The processes: what `clawr1 serve`, `up`, `train`, `train-flow` and `run-agent` run, and how.

- `server`: the one way to run the app under uvicorn with background jobs (here, or on a thread);
- `serve`: the gateway (`clawr1 serve`; `up` and the Ray head serve through it too);
- `up`: the main job (gateway + judge here, the trainer as a supervised child process; or Ray);
- `train`: the trainer process (one, or N data-parallel ranks);
- `supervise`: the one supervisor (a child process or a Ray actor's loop, started again when it dies);
- `inprocess`, `whitebox`, `blackbox`: the offline runners (the whole stack in this process).

Entrypoints import the roles (gateway, trainer, reward, flows); no role imports an entrypoint, so
flows, envs and the demo stay clients of the gateway.
"""
