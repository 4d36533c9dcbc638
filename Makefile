# Set-up and entry points. Every target creates/uses the virtual environment in $(VENV).
# On a CUDA machine, install the CUDA build instead: make test TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.hf_zero-installed

.PHONY: install demo parity-demo test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The main job: a domain-adaptation run with ZeRO-3 on 2 CPU processes, on a bundled small default
# (a generated maintenance-log corpus, a tokenizer trained on it, a small LLaMA base), then
# consolidation, a from_pretrained reload, held-out perplexity before/after and a sample generation.
# Everything lands in $(DEMO)/: corpus/, base/, run/ (checkpoints), model/ (the consolidated model).
DEMO ?= outputs/demo
DEMO_STEPS ?= 80
DEMO_ARGS = --train_files $(DEMO)/corpus --block_size 128 --seed 42

demo: $(STAMP)
	rm -rf $(DEMO)
	HF_HUB_OFFLINE=1 $(BIN)/python examples/make_demo_assets.py --out $(DEMO)
	HF_HUB_OFFLINE=1 ACCELERATE_USE_CPU=true $(BIN)/accelerate launch --config_file accelerate_configs/cpu_2proc.yaml \
		--num_cpu_threads_per_process 1 examples/train_clm.py --model_name_or_path $(DEMO)/base $(DEMO_ARGS) \
		--output_dir $(DEMO)/run --zero_stage 3 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 \
		--learning_rate 3e-3 --warmup_steps 10 --max_steps $(DEMO_STEPS) --save_steps 40 --logging_steps 10 \
		--report_to none --use_cpu
	$(BIN)/hf-zero consolidate $(DEMO)/run/checkpoint-$(DEMO_STEPS)/hf_zero $(DEMO)/model
	HF_HUB_OFFLINE=1 $(BIN)/python examples/demo_report.py --base $(DEMO)/base --trained $(DEMO)/model $(DEMO_ARGS)

parity-demo: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node 2 \
		examples/zero_parity_demo.py

test: $(STAMP)
	HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) outputs .pytest_cache
