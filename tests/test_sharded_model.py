"""A sharded model is still a whole Hugging Face model: state_dict, load_state_dict, save_pretrained,
gathered_parameters, resize_token_embeddings and generate, against the unsharded model in the same run.

Tolerance: fp32 training, 1e-5 relative per tensor (reductions run in another order than the
reference's); states right after `initialize` must be bit for bit equal.
"""

from __future__ import annotations

import pytest
import torch

from tests import _engine_cases as cases_engine
from tests import _model_cases as cases
from tests._training import make_model, make_optimizer, rel_err

TOL = 1e-5
STAGES = [0, 1, 2, 3]


def _close(got: dict, want: dict, tol: float = TOL) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    worst = max((rel_err(got[k], want[k]), k) for k in want)
    assert worst[0] <= tol, worst


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {kind: cases.reference(kind, world=2) for kind in ("llama", "falcon")}


@pytest.mark.parametrize("kind", ["llama", "falcon"])
@pytest.mark.parametrize("stage", STAGES)
def test_state_dict_reads_and_load_state_dict_match_the_unsharded_model(pools, references, kind, stage):
    ref = references[kind]
    results = pools(2).values(cases.state_dict_lifecycle, kind, stage)
    for rank, r in enumerate(results):
        for k in ref["init"]:  # right after initialize: exactly the model's own values
            assert (r["init"][k] == ref["init"][k]).all(), (rank, k)
        _close(r["trained"], ref["trained"])
        _close(r["after_load"], ref["after_load"])
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) <= TOL, (r["losses"], ref["losses"])
        assert not r["load_result"].missing_keys and not r["load_result"].unexpected_keys
        if kind == "falcon":  # tied: both names, one tensor, as HF's save expects
            assert r["tied_shares_tensor"]
        n_params = len(list(make_model(kind).parameters()))
        for reads in r["reads"]:
            if stage == 3:  # every parameter rests sharded: each read refuses, naming what to use
                assert reads["refused"] == n_params and reads["read"] == 0, reads
            else:  # persistent parameters read as their state_dict values
                assert reads["refused"] == 0 and reads["read"] == n_params, reads
            assert reads["buffers"] == len(list(make_model(kind).buffers()))
    assert results[0]["rank0_only_keys"] == len(ref["init"]) and results[1]["rank0_only_keys"] == 0


@pytest.mark.parametrize("stage", [1, 3])
def test_load_state_dict_strict_nonstrict_and_shape_errors(pools, stage):
    for r in pools(2).values(cases.load_state_dict_errors, stage):
        assert "Missing key(s)" in r["strict"] and 'Unexpected key(s) in state_dict: "not.a.key"' in r["strict"]
        assert r["missing"] > 0 and r["unexpected"] == ["not.a.key"]
        assert r["loaded"] and r["kept"]
        assert "size mismatch for lm_head.weight" in r["shape"]
        assert r["unchanged_after_error"]


@pytest.mark.parametrize(
    "kind,stage,fsdp_style",
    [
        ("llama", 3, False),
        ("falcon", 3, False),
        ("llama", 1, False),
        ("falcon", 3, True),
        ("llama", 2, True),
    ],
)
def test_save_pretrained_from_every_rank_reloads_with_from_pretrained(pools, tmp_path, kind, stage, fsdp_style):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "model"
    results = pools(2).values(cases.save_pretrained_everywhere, kind, stage, str(out), fsdp_style)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    state = {k: v.numpy() for k, v in loaded.state_dict().items()}
    for r in results:
        assert set(state) == set(r["state"])
        for k, v in state.items():
            assert (v == r["state"][k]).all(), k  # the trained weights, exactly
    with torch.no_grad():
        logits = loaded(input_ids=cases.batches(2)[3, :2]).logits.numpy()
    assert rel_err(logits, results[0]["logits"]) <= TOL
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors") == ["model.safetensors"]


@pytest.mark.parametrize(
    "kind,stage,mp", [("llama", 3, "no"), ("falcon", 3, "no"), ("llama", 2, "no"), ("llama", 3, "bf16")]
)
def test_gathered_parameters_modifier_rank_writes_back_everywhere(pools, kind, stage, mp):
    results = pools(2).values(cases.modify_in_gathered_parameters, kind, stage, mp)
    # The reference: the same edit made on the unsharded model, then the same step.
    torch.set_num_threads(1)
    model = make_model(kind)
    opt = make_optimizer(model, 1e-3)
    head = model.get_output_embeddings()
    layer = model.model.layers[0] if kind == "llama" else model.transformer.h[0]
    with torch.no_grad():
        head.weight[3].fill_(0.5)
        next(layer.parameters()).mul_(0.5)
    edited = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    data = cases.batches(2)
    loss = model(input_ids=data[0], labels=data[0]).loss
    loss.backward()
    opt.step()
    loss = loss.detach()
    trained = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for r in results:
        assert r["seen_inside"] > 0
        assert r["untouched_exact"] and r["head_other_rows_exact"]  # [Note: write-back]: nothing else moves
        if mp == "no":
            _close(r["after"], edited, tol=0.0)
            assert abs(r["loss"] - float(loss)) <= TOL * abs(float(loss))
            _close(r["trained"], trained)
        else:  # bf16 compute: the edit reached the fp32 masters (0.5 and halved bf16 values are exact)
            assert (r["after"]["lm_head.weight"][3] == 0.5).all()
            assert rel_err(r["after"][r["layer_param"]], r["before"][r["layer_param"]] * 0.5) <= 1e-2
        if stage == 3:
            assert r["rests_after"] == "RestingParameter"
            assert "changed in place inside a block with modifier_rank=None" in r["read_only_error"], r[
                "read_only_error"
            ]
    assert results[0]["after"]["lm_head.weight"][3].tolist() == results[1]["after"]["lm_head.weight"][3].tolist()


@pytest.mark.parametrize("stage", [2, 3])
def test_resize_token_embeddings_on_a_sharded_model_then_training_matches(pools, stage):
    ref = cases.resize_reference(300, world=2)
    for r in pools(2).values(cases.resize_then_train, stage, 300):
        assert r["vocab"] == 300
        _close(r["state"], ref["state"])
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) <= TOL
        assert "Resize before building the optimizer" in r["error"]


@pytest.mark.parametrize("stage", [1, 3])
def test_embeddings_and_head_called_outside_the_forward_train_as_the_model_itself(pools, stage):
    """`model(inputs_embeds=model.get_input_embeddings()(ids))` and `model.lm_head(hidden)` after the forward
    (VLM, soft-prompt and auxiliary-head code): under DDP both train; here too ([Note: direct calls]). Then the
    backbone alone without grad (`model.model(ids)`, embeddings extracted) gives the unsharded model's states."""
    ref = cases.embeds_reference(world=2)
    for rank, r in enumerate(pools(2).values(cases.embeds_then_train, stage)):
        _close(r["state"], ref["state"])
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) <= TOL
        want = ref["hidden"][rank * cases.MICRO_BS : (rank + 1) * cases.MICRO_BS]
        assert rel_err(r["hidden"], want) <= TOL, rel_err(r["hidden"], want)


def test_a_forward_liger_replaced_trains_as_the_model_itself_at_stage_3(pools):
    """Liger's forward passes `lm_head.weight` to its fused loss and never calls the head (an autograd Function given
    the weight): `initialize` finds the forward and keeps the head gathered through each forward."""
    ref = cases.liger_reference(world=2)
    for r in pools(2).values(cases.liger_then_train, 3):
        _close(r["state"], ref["state"])
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) <= TOL


@pytest.mark.parametrize("kind,eos_step", [("llama", None), ("falcon", None), ("llama", 1)])
def test_generate_with_ranks_finishing_at_different_steps_returns_everywhere(pools, kind, eos_step):
    results = pools(2).values(cases.generate_unevenly, kind, eos_step, timeout=120)
    for r in results:
        assert r["got"] == r["expected"]
    assert len(results[0]["got"][0]) != len(results[1]["got"][0])  # the ranks really did stop at different steps


@pytest.mark.parametrize("how", ["tokenizer", "metadata"])
def test_checkpoint_commit_errors_raise_on_every_rank_quickly(pools, tmp_path, how):
    results = pools(2).values(cases.save_checkpoint_commit_error, str(tmp_path / "ckpt"), how, timeout=120)
    for r in results:
        assert r["error_type"] is not None and r["seconds"] < 30, r
    cause = "this tokenizer cannot be saved" if how == "tokenizer" else "JSON-serializable"
    assert cause in results[0]["error"] and cause in results[1]["error"] and "rank(s) [0]" in results[1]["error"]
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt.incomplete-*"))


def test_seq2seq_trainer_generation_is_synced_and_matches(pools, tmp_path):
    results = pools(2).values(cases.seq2seq_trainer_predict, str(tmp_path / "out"), timeout=180)
    model = make_model("llama").eval()
    want = model.generate(cases._Prompts.ROWS, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for r in results:
        assert r["sharded"] and r["synced"] and all(s is True for s in r["synced"]), r["synced"]
        got = torch.tensor(r["predictions"])
        assert torch.equal(got[:, : want.shape[1]], want)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("mixed_precision", ["bf16", "no"])
def test_weights_changed_in_place_between_steps_reach_the_masters(pools, stage, mixed_precision):
    """[Note: edits between steps] every weight halved in place after each step (`p.mul_` under no_grad, or through
    `p.data`), as DDP code does: the same losses and weights, bit for bit, as the same change made inside
    `gathered_parameters(modifier_rank=0)` (which writes the changed elements into the masters), and a state dict
    right after the change holds it. Under bf16 the change used to reach only the compute weights, and the next
    step's publish wrote the fp32 masters over it."""
    runs = {
        how: pools(2).values(cases_engine.weights_edited_between_steps, stage, mixed_precision, how)[0]
        for how in ("none", "plain", "data", "gathered")
    }
    _assert_edits_kept(runs)


def _assert_edits_kept(runs: dict) -> None:
    """The weights changed in place (`plain`, `data`) train bit for bit as those changed inside
    `gathered_parameters` (`gathered`), and differently from no change (`none`)."""
    for how in ("plain", "data"):
        assert runs[how]["losses"] == runs["gathered"]["losses"], how
        for name, value in runs["gathered"]["final"].items():
            assert torch.equal(runs[how]["final"][name], value), (how, name)
            assert torch.equal(runs[how]["after_first"][name], runs["gathered"]["after_first"][name]), (how, name)
    assert runs["plain"]["losses"][2] != runs["none"]["losses"][2]


@pytest.mark.parametrize(
    ("stage", "mixed_precision", "where"), [(1, "bf16", "host"), (2, "bf16", "disk"), (0, "no", "disk")]
)
def test_weights_changed_in_place_between_steps_reach_offloaded_masters(pools, tmp_path, stage, mixed_precision, where):
    """[Note: edits between steps] the same halving with the masters offloaded: to the host (on this CPU the master
    is a tensor beside the chunk, compared element by element) or to files (a fingerprint of the chunk taken at each
    publish, and the master read, changed and written back only where it moved). Bit for bit the run that changes
    the weights inside `gathered_parameters(modifier_rank=0)`; before, the change was dropped at the next step."""
    offload_dir = "host" if where == "host" else str(tmp_path)
    runs = {
        how: pools(2).values(cases_engine.weights_edited_between_steps, stage, mixed_precision, how, offload_dir)[0]
        for how in ("none", "plain", "data", "gathered")
    }
    _assert_edits_kept(runs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fingerprint_moves_with_any_change_of_the_bits(dtype):
    """[Note: edits between steps] the fingerprint of a chunk whose master is elsewhere: the same for the same bits,
    different after one bit of one element flips (first, last, in the middle), after two elements swap places
    (in one piece, or at the same offset of two pieces), and after 0.0 becomes -0.0."""
    from hf_zero.dtypes import AT_ONCE_NUMEL as _PRINT_PIECE  # the elements a fingerprint multiplies at once
    from hf_zero.engine.flat import fingerprint

    torch.manual_seed(0)
    base = torch.randn(2 * _PRINT_PIECE + 7).to(dtype)
    base[11] = 0.0
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    before = fingerprint(base)
    assert fingerprint(base.clone()) == before

    def changed(edit) -> bool:
        edited = base.clone()
        edit(edited)
        return bool(fingerprint(edited) != before)

    for index in (0, base.numel() - 1, _PRINT_PIECE + 3):
        assert changed(lambda t, i=index: t.view(bits)[i].bitwise_xor_(1)), index

    def swap(i: int, j: int):
        def edit(t: torch.Tensor) -> None:
            t[[i, j]] = t[[j, i]]

        return edit

    assert base[5] != base[9] and base[5] != base[5 + _PRINT_PIECE]
    assert changed(swap(5, 9))
    assert changed(swap(5, 5 + _PRINT_PIECE))
    assert changed(lambda t: t[11].neg_())


# the slow tier (13 s a stage on 2 cores): compilation stays in the suite through the Trainer's regional compilation
# (tests/test_trainer.py) and the refusals (tests/test_accelerate.py)
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_sharded_model_called_through_torch_compile_trains_as_the_model_itself(pools, stage):
    """`model = torch.compile(model)` after `initialize` ([Note: compile]; the whole model: dynamo breaks the graph
    at the engine's hooks): compiled frames on every rank, and the same losses and weights, bit for bit, as the
    uncompiled model with the `aot_eager` backend (no code generation; `inductor` gave the same losses to 1e-7 in a
    probe on this CPU)."""
    for r in pools(2).values(cases_engine.compiled_steps, stage, "aot_eager"):
        assert r["frames"] >= 1, r["frames"]
        assert r["compiled"][0] == r["eager"][0]
        for name, value in r["eager"][1].items():
            assert torch.equal(r["compiled"][1][name], value), name


def test_a_compiled_wrapper_passed_to_the_api_is_named_with_the_way_round():
    """`model = torch.compile(model)` after `initialize`, then `save_checkpoint(model, ...)`: the wrapper is not the
    sharded model; the error says so and names `compiled._orig_mod` (checked on a stand-in engine: the wrapper is
    made without compiling anything)."""
    from hf_zero.engine.module import ENGINE_ATTR, get_engine

    inner = torch.nn.Linear(2, 2)
    inner.__dict__[ENGINE_ATTR] = object()  # what `attach` leaves on a sharded model
    with pytest.raises(
        ValueError, match=r"OptimizedModule is not sharded .* pass the model you compiled, `compiled._orig_mod`"
    ):
        get_engine(torch.compile(inner))
    with pytest.raises(
        ValueError, match=r"Linear is not sharded by hf_zero: pass the model returned by hf_zero.initialize\.$"
    ):
        get_engine(torch.nn.Linear(2, 2))
