from gpudiag.cli import main

main()
