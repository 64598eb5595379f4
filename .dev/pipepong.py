import os, time, mmap, numpy as np
n=2000
r1,w1=os.pipe(); r2,w2=os.pipe()
pid=os.fork()
if pid==0:
    for i in range(n):
        os.read(r1,1); os.write(w2,b"x")
    os._exit(0)
t0=time.perf_counter()
for i in range(n):
    os.write(w1,b"x"); os.read(r2,1)
print(f"pipe rtt {(time.perf_counter()-t0)/n*1e6:.1f} us")
os.waitpid(pid,0)
