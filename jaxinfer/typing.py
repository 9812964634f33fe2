"""Shape letters: one legend for the whole project.

Every intermediate array carries a trailing shape comment (`x = ...  # [B, T, D]`) and einsum
strings use the same letters in lower case (`"btd,dnh->btnh"`). Each letter has exactly one
meaning everywhere (models, engine, kernels, training, checkpoints, benchmarks):

    B   batch: rows of a rectangular batch (reference `generate`, training, perplexity)
    T   query tokens: the padded token count of a step (all sequences of a ragged step
        together), or the tokens of each row of a batch; a matmul's rows when leading axes
        are flattened into tokens
    S   key tokens: the key/value length a query attends over
    D   embed (model width)
    N   query heads
    K   key/value heads
    G   group: query heads per key/value head (N / K)
    H   head dim
    F   mlp: the feed-forward hidden width (per expert in a MoE layer)
    V   vocab
    E   experts
    A   active experts per token (the router's top_k)
    L   layers
    P   pages of the paged KV cache pool
    Z   page size: tokens per page
    Q   sequences of a ragged step (per-sequence metadata, padded to max_num_seqs;
        `cu_q_lens` is [Q + 1])
    R   draft tokens per sequence in speculative decoding (R + 1 positions are verified)
    M   top-logprobs: logprobs returned per token
    I   input features of a (quantized) matmul
    O   output features of a (quantized) matmul
    C   quantization groups along I (I / group_size)
    W   windows of a packed token dataset (training and perplexity data)

Conventions:

    X'      X padded (to a bucket or a tile): `[T', K, G, H]`
    X * Y   flattened axes: `[B * T, D]`; `2K` is keys and values interleaved, `H/2` half a head
    lower   a lower-case name in a shape is a variable or parameter of that code, not a letter
            of the legend: `[Q, pages_per_seq]`, `[block_m, block_k]`, `[C, group_size, O]`
    ...     any leading axes

Letters not in the legend (J, U, X, Y) are free; add one here before using it in a comment.
This module is documentation only: it defines nothing and costs nothing to import.
"""
