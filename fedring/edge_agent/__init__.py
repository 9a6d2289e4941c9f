"""The agent daemon that runs on each board (daemon, one round's worker, state and
checkpoints). Built by the MQTT agent/coordinator issue; nothing here yet.
"""
