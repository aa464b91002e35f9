"""OpenAI-compatible HTTP server over a multi-process runtime.

    HTTP process (uvicorn/FastAPI)                     scheduler process
    http_server  -> openai_api / native routes         scheduler_process: Engine.step() loop
    tokenizer_manager: tokenize, render chat,  --zmq-> add_request / abort / stats
        admit (queue limit), route outputs    <-zmq--  detokenizer: per-step text deltas, ids, logprobs

Messages between the processes are the plain dataclasses of io_struct (pickled over pyzmq on loopback IPC).
The HTTP process's EngineSupervisor (supervisor) restarts a dead scheduler process; its Heartbeat messages tell
a stuck one. Input limits (request_body, api_models) and one error shape (errors) keep any bad request a 4xx.
"""
