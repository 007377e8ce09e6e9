from minivllm.entrypoints.cli import main

if __name__ == "__main__":  # spawned tensor-parallel workers import this module too
    main()
