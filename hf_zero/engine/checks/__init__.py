"""The engine's checks that what every rank does is what DDP would train, each refusing by name where it is not:
the units check (`units_run.py`: units run or changed in place on some ranks), the forward checks (`forward.py`:
parameters and modules replaced since `initialize`, uneven inputs), the call order (`call_order.py`: the engine's
collective calls made in the same order on every rank) and the same model (`same_model.py`: one model and one
config on every rank, before anything is sharded). Each owns its state and its error messages; the hooks and the
engine call them at fixed points of a pass."""
