"""Named real models: fetch, convert and cache them as local Hugging Face directories (`specmask models`)."""
