"""The engine's drivers, behind one interface (`client.EngineClient`): StreamingEngine (the engine
loop on a thread of this process) and EngineProcess (in a process of its own), the loop they
share (`EngineCore`) and the messages between them. Importing this package imports no torch."""
