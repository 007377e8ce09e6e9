from minivllm.entrypoints.cli import main

main()
