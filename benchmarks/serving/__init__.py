"""The server and its deployments, driven by clients in other processes: load (`load`, with py-spy profiles of
the core and the API workers: `profiling`), the soak (`soak`), start-up to /ready (`startup`), an LLM's first
token to first audio through the engine, Pipecat and the WebSocket (`turn_latency`), and Ray Serve's scaling
(`ray_scaling.sh`)."""
