"""What a submission decides for the nodes it found, one module per decision.

- :mod:`.facts`: what the probe found on the GPU nodes, as far as a decision depends on it;
- :mod:`.decisions`: every node-dependent decision of one submission, made together from those facts;
- :mod:`.attention`: which attention the actor runs, and which paths need flash-attn;
- :mod:`.fastpath`: flash-attn's fast path (packed sequences, dynamic batches) or SDPA with fused kernels;
- :mod:`.warmstart`: the workers' warm caches and validation on a resumed attempt;
- :mod:`.choices`: a decision's value against the user's own (the user's wins, the record says both).
"""
