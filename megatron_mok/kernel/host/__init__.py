"""Host side of the CUDA libraries, as csrc/mok/host: building and loading them (build, library), their launch
structs' host arrays (cargs), error records (errors), availability, and the expert-weight check memo."""
