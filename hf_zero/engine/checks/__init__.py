"""The engine's checks that what every rank does is what DDP would train, each refusing by name where it is not: the
forward checks (`forward.py`: uneven inputs, parameters and modules replaced since `initialize`), the call order
(`call_order.py`: the engine's collective calls made in the same order on every rank), the graph a double backward
keeps (`double_backward.py`), the parameters a forward changed in place (`changed_in_forward.py`), the units check
(`units_run.py`: units run or changed in place on some ranks) and the same model (`same_model.py`: one model and one
config on every rank, before anything is sharded). Each owns its state and its error messages; all but the same
model (checked by `initialize`, before any pass) are `PassListener`s the hooks tell of a pass's events in one loop
([Note: pass events] in pass_events.py)."""
