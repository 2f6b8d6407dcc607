"""Ways to keep replicas in step: DDP, the manual strategies, DataParallel, ZeRO."""
