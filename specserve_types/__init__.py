"""What every layer shares, importing nothing else from this repository: public request and
response types with the user-facing errors (api), the engine<->worker round messages
(round_messages), stream/proto conversion (protocol) and the generated gRPC code (proto/)."""
