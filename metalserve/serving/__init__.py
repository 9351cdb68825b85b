"""The one place that builds engines: config -> loaded model -> KV spec -> pool plan -> scheduler + runner +
connector -> engine, for one model (build.py), several models (the registry, its threads and the memory
budget) and pipeline stages (pipeline.py). engine/ runs what is built here; api/ receives a ready registry."""
