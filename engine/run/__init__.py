"""A run from its specification to its record: the spec, preparing the model, the decode loop, one step,
text in and out, the typed rows, the recorder, teacher-forced quality and the dashboard's generation process."""
