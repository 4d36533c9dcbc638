"""[Note: read ahead] in hf_zero/checkpoint/pretrained.py: the sharded load reads the next units while it casts one."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tests._training import make_model


def test_units_are_read_two_at_once_and_the_spare_read_buffers_given_back(tmp_path, monkeypatch):
    """[Note: read ahead] in hf_zero/checkpoint/pretrained.py: while one unit is cast into its shard, the next two
    are read at once (each read slowed here so that they must overlap); the weights are the files'; afterwards one
    pair of direct-read buffers is kept ([Note: bounce])."""
    import threading
    import time

    import hf_zero
    from hf_zero.checkpoint import pretrained, sequential

    make_model("llama").save_pretrained(tmp_path / "base")
    running, most = [0], [0]
    lock = threading.Lock()
    read_unit = pretrained.PretrainedSource._read_unit

    def slow_read(self, *args):  # noqa: ANN001, ANN202
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        try:
            return read_unit(self, *args)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(pretrained.PretrainedSource, "_read_unit", slow_read)
    model, _ = hf_zero.from_pretrained(AutoModelForCausalLM, str(tmp_path / "base"), hf_zero.ZeroConfig(stage=3))
    assert most[0] == pretrained.AHEAD == 2
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "base").state_dict()
    got = hf_zero.full_state_dict(model)
    assert all(torch.equal(got[name], value) for name, value in expected.items())
    assert len(sequential._BOUNCE) <= 1
