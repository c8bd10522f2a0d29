"""A model's costs, the second step: the call graph priced as a `strategies.Chain`.

`call_memory` (what one call keeps for its backward, read from its traced
gradient graph), `measured` (calls that graph cannot show, run and measured
with the allocator), `policy_state` (what a link keeps and costs recomputed
under a policy: the third state) and `profile` (`profile()`: the chain,
assembled in named phases).
"""
