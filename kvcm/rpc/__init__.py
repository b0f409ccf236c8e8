"""The RPC layer: frames on the ROUTER socket, the method table, authentication, the side HTTP port."""
