"""The optimizer side of the engine: where the master shards live (master.py, disk.py), the pieces and chunks
the user's optimizer steps (pieces.py, whole.py, optim_configs.py), the wrapped optimizer and its rounds of steps
(optim.py, stepping.py), loss scaling (scaler.py) and gradient clipping (torch_clip.py)."""
