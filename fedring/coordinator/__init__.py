"""The coordinator service (enrolment, rounds, membership, report, ONNX export). Built
by the MQTT agent/coordinator issue; nothing here yet.
"""
