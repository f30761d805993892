from artery.services.inference.main import main

# Guarded: the vLLM engine spawns its engine core, which imports the parent's main module again.
if __name__ == "__main__":
    main()
