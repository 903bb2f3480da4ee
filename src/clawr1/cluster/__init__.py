"""The Ray deployment (`clawr1 up --ray`): engine replicas behind the gateway's router, the pool
service, the trainer and the judge workers as actors. The interfaces are the single-machine ones:
`RouterEngine` is an `Engine`, `RayPool` a `DataPool`."""
