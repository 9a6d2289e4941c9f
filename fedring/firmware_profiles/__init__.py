"""One TOML profile per board (Raspberry Pi, Jetson, generic x86_64): `schema` loads and
checks them, `detect` finds this board's, `apply` sets an agent up from one and refuses
jobs that would not fit its memory. The simulator's virtual clock reads the same figures.
"""
