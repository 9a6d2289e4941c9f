"""One TOML profile per board (Raspberry Pi, Jetson, generic x86_64), schema and
detection. Built by the firmware profiles issue; nothing here yet.
"""
