"""A round's forward with static shapes, for capture once per shape (CUDA graphs, torch.compile): the torch/GPU path.

    buckets.py         the shapes a step may take: batch x rows per request x blocks of context (padded up)
    staging.py         one flat int64 buffer per bucket (tokens, positions, slots, block tables, past lengths,
                       row masks, the greedy chain's rows): built on the host, ONE copy to the device a step
    static_forward.py  the target's or the draft's forward over those buffers: paged attention by gathering the
                       pool through the block table on the device; no host read, no data-dependent shape
    greedy.py          argmax, a greedy chain's acceptance, a draft's greedy chain of k steps, in tensor form
    capture.py         one program per bucket: eager, torch.compile, or a CUDA graph replayed per round
    runner.py          CausalLM.forward_seqs' contract through the captured programs (eager past the buckets)
    modes.py           the config's `capture` (off, auto, a mode) resolved per worker: device, ranks, precision

The workers run it through model_runtime/tp.py's TPRank (one rank) when `capture` resolves to a mode (auto: CUDA
graphs on a CUDA device). The CPU's default path (the C++ kernels, q4, the AMX layer loop) does not go through
here: docs/gpu.md.
"""
