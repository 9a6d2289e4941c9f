"""fedring over Flower 1.4x (Message API): ClientApp, ServerApp, compression mod, ring relay.

Only this package imports `flwr`; an agent that speaks MQTT needs neither Flower nor Ray.
`carrier`, `node`, `star` and `job` hold the logic without Flower; `client_app`,
`server_app`, `mod`, `ring_relay` and `simulation` are the Flower glue.
"""
