"""One module per DAG stage. Each declares its params section (a pydantic model) and a `run` entry that reads its
inputs, calls `models`, writes its outputs atomically and sends metrics to the `report` callback it is given.
Stages never import `pipeline`."""
