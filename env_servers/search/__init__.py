"""Search-R1's question answering with a search tool (verl-agent's Search environment).

`env.SearchEnv` is the env an env server hosts; `reward` holds Search-R1's answer
normalisation, exact match and F1; `data` loads a question/corpus directory (the frozen
synthetic one of `synthetic`, or Search-R1's released files); retrieval is
`env_servers.retriever` (in process or a separate gRPC server).
"""
