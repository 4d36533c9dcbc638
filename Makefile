# Set-up and entry points. Every target creates/uses the virtual environment in $(VENV).
# On a CUDA machine, install the CUDA build instead: make test TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.hf_zero-installed

.PHONY: install demo parity-demo test test-slow fuzz docs design-map lint gpu-check gpu-rehearse gpu-wheels compat clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The main job: domain adaptation of a small pretrained LLaMA to real text with ZeRO-3 on 2 CPU processes.
# The domain is the Python standard library's documentation, the base model is first pretrained on general
# text (installed packages' READMEs and licenses; about 2 minutes, cached in $(DEMO_CACHE)); nothing is
# downloaded. Then: training with accelerate launch + ZeroTrainer, consolidation, a from_pretrained reload,
# and held-out perplexity of base and adapted model on the domain and on general text, with the runtime.
# Everything lands in $(DEMO)/: corpus/ and general/ (train/held-out jsonl), base/, run/, model/, report.json.
DEMO ?= outputs/demo
DEMO_CACHE ?= outputs/demo_cache
DEMO_STEPS ?= 120

demo: $(STAMP)
	rm -rf $(DEMO) && mkdir -p $(DEMO) && date +%s > $(DEMO)/started
	HF_HUB_OFFLINE=1 $(BIN)/python examples/make_demo_assets.py --out $(DEMO) --cache $(DEMO_CACHE)
	HF_HUB_OFFLINE=1 ACCELERATE_USE_CPU=true $(BIN)/accelerate launch --config_file accelerate_configs/cpu_2proc.yaml \
		--num_cpu_threads_per_process 1 examples/train_clm.py --model_name_or_path $(DEMO)/base \
		--train_files $(DEMO)/corpus/train.jsonl --validation_files $(DEMO)/corpus/held_out.jsonl --block_size 128 \
		--output_dir $(DEMO)/run --zero_stage 3 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 \
		--learning_rate 2e-3 --warmup_steps 10 --max_steps $(DEMO_STEPS) --save_steps 60 --logging_steps 20 \
		--seed 42 --report_to none --use_cpu --disable_tqdm true
	$(BIN)/hf-zero consolidate $(DEMO)/run/checkpoint-$(DEMO_STEPS)/hf_zero $(DEMO)/model
	HF_HUB_OFFLINE=1 $(BIN)/python examples/demo_report.py --assets $(DEMO) --trained $(DEMO)/model --run $(DEMO)/run \
		--started $$(cat $(DEMO)/started)

parity-demo: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node 2 \
		examples/zero_parity_demo.py

test: $(STAMP) lint
	HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q

# The slow tier (pyproject's `slow` marker): heavy repeats of what `make test` covers: the GPU check's CPU
# rehearsal, more shapes of the memory estimate, train_accelerate resumed from a background save, the DPO runs (plain and sync-ref), the SFT example with sequence parallelism,
# train_clm with sequence parallelism on long blocks, the two-node launch, a preempted job's exit 75 through torchrun,
# accelerate launch and direct launch and its requeue, load_state on one rank, torchao's AdamW8bit, the
# loading-memory control, a user script's clean exit (2 launches), the Trainer's auto_find_batch_size and block-less models at stage 2, torch.compile of a whole llama
# through the Trainer and of a sharded model at stage 1; then the soaks (20 clean-exit launches, a rank killed before each of the save path's 8
# collectives).
test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q -m slow
	HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 HF_ZERO_EXIT_LAUNCHES=20 HF_ZERO_SAVE_KILL_POINTS=0,1,2,3,4,5,6,7 \
		$(BIN)/python -m pytest -q -o addopts="" tests/test_reliability.py -k "exits_0 or inside_the_save_path"

# The differential fuzzer (tests/_fuzz.py): FUZZ_PROGRAMS training programs drawn from seeds, each under torch's DDP
# and under hf_zero at stages 1-3 on 2 gloo ranks; the report (counts, seeds, any silent divergence with its shrunk
# program) lands in benchmarks/results/fuzz.md. About 1 s a program on 2 CPU cores.
FUZZ_PROGRAMS ?= 1000
FUZZ_FIRST_SEED ?= 0

fuzz: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python benchmarks/fuzz.py --programs $(FUZZ_PROGRAMS) \
		--first-seed $(FUZZ_FIRST_SEED)

# The documentation site (mkdocs.yml): http://127.0.0.1:8000 while it runs; tests/test_docs.py builds it strictly.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# docs/design.md's file map, from each module's docstring (tests/test_code_notes.py checks it is current).
design-map: $(STAMP)
	$(BIN)/python -m tests._design_map --write > /dev/null

# Lint, format and type checks of the package (settings in pyproject.toml); `make test` runs them first.
lint: $(STAMP)
	$(BIN)/ruff check
	$(BIN)/ruff format --check
	$(BIN)/mypy

# The CUDA + NCCL path on the one GPU a session is lent (docs/performance.md, "The GPU check"): runs with the
# python3 there whose torch sees CUDA, hf_zero from this tree, nothing from a network (wheels from .whl/); seven
# phases in about 6 minutes; report.md / report.json in $$OUT (the device tool's) or outputs/gpu_check.
# Without a GPU it says so and exits 0. gpu-rehearse runs the same phases here on the CPU, from no index.
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py

gpu-rehearse: $(STAMP)
	PIP_NO_INDEX=1 $(BIN)/python benchmarks/gpu_check.py --rehearse --out outputs/gpu_rehearsal

# The pure-Python wheels the lent machine lacks (benchmarks/gpu_wheels.txt), for its Python 3.12, into .whl/.
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl -r benchmarks/gpu_wheels.txt
	du -sh .whl

# The core tests on the lent GPU machine's stack (torch 2.11, transformers 5.17, accelerate 1.15, safetensors
# 0.8), in a venv of their own on the CPU; results in benchmarks/results/compat.md. CI runs today's pins only.
COMPAT_VENV ?= .venv-compat
COMPAT_PINS ?= torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0
COMPAT_TESTS ?= tests/test_parity.py tests/test_checkpoint.py tests/test_trainer.py tests/test_accelerate.py \
	tests/test_consolidate.py tests/test_offload.py tests/test_precision_and_lifecycle.py tests/test_gpu_check.py

compat:
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q $(COMPAT_PINS) "pytest>=8" "pytest-timeout>=2.3" "datasets>=5.2" \
		"peft>=0.21" "schedulefree>=1.4" "torch-optimi>=0.3" "torchao>=0.11" "bitsandbytes>=0.45" "galore-torch>=1.0" \
		"apollo-torch>=1.0"
	$(COMPAT_VENV)/bin/python -m pip install -q --no-deps -e .
	HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 $(COMPAT_VENV)/bin/python -m pytest -q -rfEs $(COMPAT_TESTS) \
		--deselect "tests/test_trainer.py::test_optim_choices_at_stage_3_match_the_stock_trainer[stable_adamw]"
# (deselected: PyPI's torch 2.11 is a CUDA build that brings triton, and torch-optimi 0.3.3 then runs StableAdamW's
# triton kernel on CPU tensors and fails with no GPU driver, with or without hf_zero; compat.md)

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .whl outputs .pytest_cache
