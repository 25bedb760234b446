"""Elastic Attention (arXiv 2601.17367), a small readable reference.

Each attention head of a Llama-style model is FULL or sparse per input, chosen by a router that reads
the prompt. The pieces, one file each, in reading order:

    model.py       the model: Config, Transformer, Attention (the method's three steps), generation
    router.py      routers, the hard-concrete gate, the sparsity objective (Lagrangian)
    kernels.py     attention kernels: a streaming and a block-sparse Triton kernel beside naive twins
    masks.py       naive attention and the masks: the ground truth every kernel is tested against
    xattention.py  XAttention's block selection (the block-sparse mode)
    decode.py      generation with a compact per-head KV cache
    tasks.py       the synthetic retrieval / local tasks the routers train on

`import elastic_attention` gives the model's names (Config, Transformer, ...) and the modules.
"""
from . import decode, kernels, masks, router, tasks, xattention
from .masks import BLOCK_SPARSE, FULL, STREAMING
from .model import (BACKENDS, DEPLOYS, GATES, HEAD_CONFIGS, MODEL_SHAPES, Attention, Block, Config,
                    Transformer, from_pretrained_hf, load_checkpoint, load_hf_state_dict,
                    read_checkpoint, rope_tables, save_checkpoint, write_atomic)
