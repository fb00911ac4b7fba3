"""WebSocket server: protocol v1 (docs/PROTOCOL.md), security, metrics, the demo page."""
