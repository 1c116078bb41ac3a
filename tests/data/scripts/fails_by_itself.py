import torch

config = {"lr": 0.1}
model = torch.nn.Linear(4, 4).cuda()
print(config["learning_rate"])   # a bug of the script's own
