"""The control plane: storages, instance groups, instances and accounts, persisted in the store."""
