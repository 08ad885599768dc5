# Web search flow-size distribution (DCTCP, SIGCOMM 2010), as used by pFabric, HPCC and the
# MP-RDMA evaluation. Columns: flow size in bytes, cumulative probability.
0 0
10000 0.15
20000 0.20
30000 0.30
50000 0.40
80000 0.53
200000 0.60
1000000 0.70
2000000 0.80
5000000 0.90
10000000 0.97
30000000 1.00
