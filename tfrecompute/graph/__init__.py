"""A model's call graph, the first step of the path: which calls a plan chooses among.

`layer_graph` (the `LayerGraph` of a Sequential or Functional model: its calls
in order, with the tensors between them), `call_tree` (every layer and
operation call of one traced forward, for any model) and `expand` (that tree
expanded into the chain of calls of any model: subclassed layers opened where
they hold layers).
"""
