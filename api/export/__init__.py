"""Export a sweep's ranked layout to torchtitan, Megatron-LM, DeepSpeed or Megatron-Bridge (NeMo)
configuration: ``service.export_sweep`` (what the route, the dashboard and
``meshtune export`` call) over ``tuner.export_layout``; ``routes.router`` serves
``GET /api/sweeps/{id}/export``."""
