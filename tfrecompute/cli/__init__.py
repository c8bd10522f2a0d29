"""The command line (`command`: the `tfrecompute` script) and its figures (`plots`).

`plots` needs matplotlib and no TensorFlow; `command.main` runs both
`tfrecompute ...` and `python -m tfrecompute ...`.
"""
