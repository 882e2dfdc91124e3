"""The Router replica's side of the other deployments, through their Serve handles.

- `fan_in`: `ImageFanIn`, a request's images preprocessed and encoded concurrently.
- `failures`: Ray/Serve failures of a call (replica gone, backpressure, an error raised in the
  replica) mapped to OpenAI-style `APIError`s.

Unlike `moonserve.pipeline.api` (the pure HTTP edge) this knows Ray: its exception types and its
DeploymentResponse.
"""
