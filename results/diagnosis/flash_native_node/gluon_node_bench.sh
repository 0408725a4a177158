set -e
python3 -m pip install -q --no-index --find-links .whl snakemake ninja
export PATH=$(python3 -c 'import sysconfig;print(sysconfig.get_path("scripts"))'):$PATH PYTHONPATH=$PWD CS336_GIT_COMMIT=26c74db
P6="flash_triton flash_triton_compiled sdpa_flash sdpa_flash_compiled sdpa_cudnn sdpa_cudnn_compiled"
B="python3 -m cs336_systems.bench.flash_bench llm-shapes --causal on --rounds 5"
$B --batch-heads 16 64 --seqs 512 1024 2048 --head-dims 64 128 --providers $P6 --out $OUT/short.csv > $OUT/short.log 2>&1
$B --batch-heads 256 --seqs 1024 2048 --head-dims 64 128 --providers $P6 --out $OUT/gluon.csv > $OUT/gluon.log 2>&1
$B --batch-heads 16 --seqs 4096 --head-dims 128 --providers $P6 --out $OUT/gluon4096.csv > $OUT/gluon4096.log 2>&1
export CS336_FLASH_NATIVE=0
$B --batch-heads 16 64 --seqs 512 1024 2048 --head-dims 64 128 --providers flash_triton flash_triton_compiled --out $OUT/short_native_off.csv > $OUT/short_native_off.log 2>&1
$B --batch-heads 256 --seqs 1024 2048 --head-dims 64 128 --providers flash_triton flash_triton_compiled --out $OUT/gluon_native_off.csv > $OUT/gluon_native_off.log 2>&1
$B --batch-heads 16 --seqs 4096 --head-dims 128 --providers flash_triton flash_triton_compiled --out $OUT/gluon4096_native_off.csv > $OUT/gluon4096_native_off.log 2>&1
echo done
