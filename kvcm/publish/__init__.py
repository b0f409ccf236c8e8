"""kvcm to the outside: its own KV events, the JSON-lines event log, and the bridge that feeds both."""
