"""Running on TPU slices: topologies, ahead-of-time compile, Cloud TPU and GKE backends, local processes, the
babysitter and `bertjax launch`."""
