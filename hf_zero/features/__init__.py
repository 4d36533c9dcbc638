"""Model features the engine offers on top of sharding, below the public API and above the engine: sequence
parallelism (`sequence_parallel`), the tiled MLP and loss (`tiled_mlp`, `tiled_loss`) and per-block compilation
(`compile`). They patch or wrap a model's own modules and import neither transformers nor Accelerate at module
level; `integrations/` holds the transformers and Accelerate glue only."""
