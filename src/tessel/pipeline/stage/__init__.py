"""A pipeline stage process: its entry point (`worker`, light), its life from loading to serving
(`process`), its layers run by the engine's model runner (`runner`) and its loop (`loop`)."""
