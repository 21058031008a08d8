"""CRAIG weighted coresets (Mirzasoleiman et al., ICML 2020) for GPT pretraining.

A coreset is a weighted subset S of the training samples whose weighted gradient sum
approximates the full data's: Σ_{i<n} ∇l_i ≈ Σ_{j∈S} γ_j ∇l_j, with γ_j the number of
training samples that sample j stands for (Σγ = n, the number of training samples).

* :mod:`.identity` — what a coreset file was made for (dataset, split, sequence length, seed,
  tokenizer, training sample count), the ``.npz`` file, and the training flag ``--coreset``
  with its checks (pure Python, before any communication);
* :mod:`.facility` — lazy-greedy facility location per shard and the weights γ (numpy);
* :mod:`.proxies` — per-sample gradient proxies: the output layer's gradient (torch);
* :mod:`.training` — the coreset's sample stream and weighted loss for the training loop;
* :mod:`.select` — ``scripts/select_coreset.py``: build the training samples, compute the
  proxies with a loaded or briefly warmed-up model, select, write the file.

See docs/coresets.md.
"""
