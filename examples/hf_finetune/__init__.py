"""Fine-tune a Hugging Face causal LM with ``lightning_accum``: split by tokens, exact token means, DDP, W&B offline.

The model is a ``transformers`` causal LM built from a ``GPT2Config`` (or loaded from a local checkpoint with
``--model.checkpoint``); the data are synthetic instruction/response pairs of token ids, so no tokenizer and no
download is needed. Install the extras first::

    pip install -e ".[hf,cli,report,wandb]"

and run from the repository root (2 CPU ranks, about a minute)::

    OMP_NUM_THREADS=1 python -m examples.hf_finetune.main fit --config examples/hf_finetune/configs/ddp_cpu.yaml
"""
