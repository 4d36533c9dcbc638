# Set-up and entry points. Every target creates/uses the virtual environment in $(VENV).
# On a CUDA machine, install the CUDA build instead: make test TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.hf_zero-installed

.PHONY: install demo parity-demo test lint gpu-check clean

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

# Lint, format and type checks of the package (settings in pyproject.toml); `make test` runs them first.
lint: $(STAMP)
	$(BIN)/ruff check
	$(BIN)/ruff format --check
	$(BIN)/mypy

# The CUDA + NCCL path on a machine with NVIDIA GPUs: installs the CUDA build of the pinned torch in .venv-cuda,
# runs the parity demo under torchrun on every GPU, the device-agnostic tests (parity, checkpoints, Trainer,
# bf16/fp16) on CUDA + NCCL and the benchmark beside DDP/FSDP2/DeepSpeed; report in outputs/gpu_check/report.md.
# Without a GPU it says so and exits 0. Another CUDA build: make gpu-check CUDA_TORCH_SPEC="torch==2.13.0 --index-url ..."
CUDA_TORCH_SPEC ?= torch==2.13.0

gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --venv .venv-cuda --torch "$(CUDA_TORCH_SPEC)"

clean:
	rm -rf $(VENV) .venv-cuda outputs .pytest_cache
