"""Where arrays live: the device mesh's shardings, their constraints inside jit, multihost."""
