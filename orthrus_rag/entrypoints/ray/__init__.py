"""Scale-out on Ray Serve: engine replicas (each one engine loop serving both kinds in one forward pass) behind one
OpenAI-compatible ingress. `replica.py` is a replica, `client.py` the `EngineClient` over their deployment handle,
`app.py` builds and runs the application."""
