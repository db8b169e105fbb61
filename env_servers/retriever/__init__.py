"""Passage retrieval for the search environment: a BM25 index (`index`), its gRPC server
(`python -m env_servers.retriever`, `server`) and the client the env calls (`client`).

The env retrieves in process (`LocalRetriever`) unless given a server address; both
answer the same `search(queries, topk)` with the same ranking.
"""
